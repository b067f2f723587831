"""Does the embedding order captions from generic to specific? The scenes make entailment exact.

For each test scene, one object is described by a chain of captions, each naming one attribute fewer:

    level 4  "a photo of a small red star in the top left."   (size, colour, shape, grid cell)
    level 3  "a photo of a small red star."
    level 2  "a photo of a red star."
    level 1  "a photo of a star."
    level 0  "a photo of an object."                           (true of every scene)

Every caption of the chain is true of the scene, and each entails the ones below it (a scene it describes,
they describe too: `Mention.matches`). MERU's two measures (Desai et al., 2023, §5):

- **nearer the origin**: for every pair of levels i < j of a chain, whether the generic caption (i) lies
  nearer the origin than the specific one (j), d₀(x) = −s(x, origin) with the model's own similarity
  (arcosh-based for the hyperboloids, summed over the factors of a product; ‖x‖ in Euclidean space): each
  chain's share of its 10 pairs, averaged over the chains with a 95 % interval (a chain is the unit: its pairs
  share captions), and per pair of levels a Wilson interval (one trial a chain); and how often the image lies
  farther out than its most specific caption.
- **traversal**: from each image towards the origin along the geodesic (x_s = exp₀(s · log₀ x), s from 1 to
  0; s·x in Euclidean space), the nearest caption of the pool of every chain; the mean level of what is
  retrieved at each s, and whether it is true of the image. A hierarchy shows as the level falling to 0.

On a sphere every point is as far from any centre as any other, so the measure needs an origin: the
hyperbolic topologies and Euclidean space. Every measure is given for the trained model and for an untrained one of
the same config and seed: longer captions may sit farther out before any training (an untrained lorentz model's
share ranged from 0.38 to 0.83 over seeds), so the trained share means something only beside it. Writes
hierarchy.json and hierarchy.png.
"""
from __future__ import annotations

import math

import torch

from topoclip.analysis.output import pyplot, save_figure, write_json
from topoclip.config import ConfigError
from topoclip.core import geometry
from topoclip.data.scenes.captions import COLUMN_WORDS, ROW_WORDS, Mention
from topoclip.run.evaluation.zeroshot import embed_images, embed_texts, evaluating
from topoclip.run.inference import Pretrained

LEVEL_NAMES = ("object", "shape", "colour shape", "size colour shape", "size colour shape cell")  # 0 generic … 4
LEVELS = len(LEVEL_NAMES)
TEMPLATE = "a photo of {}."
# With an origin: the hyperboloids (the exponential map's base point) and Euclidean space (0).
WITH_ORIGIN = ("lorentz", "lorentz-product", "euclidean")
Z_95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def cell_phrase(obj) -> str:
    """The grid cell of `obj` in the captions' words: "in the centre", "in the top left", "at the top", "on the left"."""
    if (obj.row, obj.column) == (1, 1):
        return "in the centre"
    if obj.row != 1 and obj.column != 1:
        return f"in the {ROW_WORDS[obj.row]} {COLUMN_WORDS[obj.column]}"
    return f"at the {ROW_WORDS[obj.row]}" if obj.row != 1 else f"on the {COLUMN_WORDS[obj.column]}"


def chain(obj) -> list[tuple[str, Mention]]:
    """The captions of levels 0 … 4 for `obj` and their meanings, each entailing the ones before it."""
    row = obj.row if obj.row != 1 or obj.column == 1 else None
    column = obj.column if obj.column != 1 or obj.row == 1 else None
    words = [("object", Mention()), (obj.shape, Mention(shape=obj.shape)),
             (f"{obj.colour} {obj.shape}", Mention(colour=obj.colour, shape=obj.shape)),
             (f"{obj.size} {obj.colour} {obj.shape}", Mention(colour=obj.colour, shape=obj.shape, size=obj.size)),
             (f"{obj.size} {obj.colour} {obj.shape} {cell_phrase(obj)}",
              Mention(colour=obj.colour, shape=obj.shape, size=obj.size, row=row, column=column))]
    return [(TEMPLATE.format(("an " if phrase[0] in "aeiou" else "a ") + phrase), meaning) for phrase, meaning in words]


def wilson(successes: int, trials: int) -> tuple[float, float]:
    """The Wilson score 95 % interval of a proportion."""
    if trials == 0:
        return (math.nan, math.nan)
    p, z2 = successes / trials, Z_95**2
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = Z_95 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials**2)) / (1 + z2 / trials)
    return (centre - half, centre + half)


def proportion(successes: int, trials: int) -> dict:
    low, high = wilson(successes, trials)
    return {"fraction": successes / trials if trials else math.nan, "trials": trials, "ci95": [low, high]}


def origin_distance(model, points: torch.Tensor) -> torch.Tensor:
    """d₀ = −s(x, origin) with the model's similarity: (N, m, n) -> (N,)."""
    origin = torch.zeros(1, *points.shape[1:], device=points.device, dtype=points.dtype)
    return -model.similarity(points, origin)[:, 0]


def towards_origin(model, points: torch.Tensor, s: float) -> torch.Tensor:
    """The point a fraction s of the way from the origin to each of `points` on the geodesic (N, m, n)."""
    if model.curvature is None:  # Euclidean: the straight line
        return points * s
    c = model.curvature_value
    rows = points if geometry.get_topology(model.config.topology).product else points.flatten(1)
    return geometry.exp_map0(s * geometry.log_map0(rows, c), c).view_as(points)


def plot(result: dict, out_dir):
    """hierarchy.png: d₀ by level (and the images), and the traversal's mean retrieved level; the untrained model's
    dashed."""
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    levels = list(range(LEVELS))
    for name, style in (("trained", "-"), ("untrained", "--")):
        measured = result[name]
        left.errorbar(levels, [row["mean"] for row in measured["origin_distance"]["captions"]],
                      yerr=[row["std"] for row in measured["origin_distance"]["captions"]], marker="o", capsize=3,
                      linestyle=style, label=f"captions ({name})")
        left.axhline(measured["origin_distance"]["images"]["mean"], color="C3", linestyle=style,
                     label=f"images ({name})")
        steps = [row["s"] for row in measured["traversal"]]
        right.plot(steps, [row["mean_level"] for row in measured["traversal"]], marker="o", linestyle=style,
                   label=f"mean level retrieved ({name})")
    left.set_xticks(levels)
    left.set_xlabel("caption level (0 generic … 4 specific)")
    left.set_ylabel("distance to the origin")
    shares = ", ".join(f"{name} {100 * result[name]['generic_nearer']['all']['mean']:.1f} %"
                       for name in ("trained", "untrained"))
    left.set_title(f"generic nearer the origin: {shares}", fontsize=9)
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    right.invert_xaxis()
    right.set_xlabel("s (1: the image … 0: the origin)")
    right.set_ylabel("caption level")
    right.set_title("traversal from the image to the origin", fontsize=9)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    figure.suptitle(f"{result['model']} ({result['topology']})", fontsize=10)
    figure.tight_layout()
    return save_figure(figure, out_dir, "hierarchy")


def chain_mean(values: torch.Tensor) -> dict:
    """The mean of one value per chain (N,) and its 95 % interval, mean ± 1.96·sd/√N: the chains are independent
    scenes, the pairs within one chain are not (they share its captions), so a chain is the unit."""
    half = Z_95 * float(values.std()) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    mean = float(values.mean())
    return {"mean": mean, "chains": len(values), "ci95": [mean - half, mean + half]}


def measures(model, texts: torch.Tensor, images: torch.Tensor, scenes, chains, traversal_images: int,
             steps: int) -> dict:
    """The hierarchy measures of one model's embeddings: captions (N, L, m, n) and images (N, m, n)."""
    size = texts.shape[0]
    with evaluating(model), torch.no_grad():
        caption_depth = origin_distance(model, texts.flatten(0, 1)).view(size, LEVELS).cpu()  # (N, L)
        image_depth = origin_distance(model, images).cpu()  # (N,)
        nearer = {(i, j): caption_depth[:, i] < caption_depth[:, j] for i in range(LEVELS) for j in range(i + 1, LEVELS)}
        per_chain = torch.stack(list(nearer.values()), dim=1).float().mean(dim=1)  # (N,): each chain's share of pairs
        result = {"generic_nearer": {"all": chain_mean(per_chain),
                                     "adjacent": [proportion(int(nearer[(i, i + 1)].sum()), size)
                                                  for i in range(LEVELS - 1)],
                                     "pairs": {f"{i}<{j}": proportion(int(v.sum()), size) for (i, j), v in nearer.items()}},
                  "image_beyond_captions": proportion(int((image_depth > caption_depth[:, -1]).sum()), size),
                  "origin_distance": {"captions": [{"mean": float(column.mean()), "std": float(column.std())}
                                                   for column in caption_depth.T],
                                      "images": {"mean": float(image_depth.mean()), "std": float(image_depth.std())}}}
        # The traversal: every chain's captions are the pool; a retrieved caption is true of the image when its
        # meaning matches the image's scene (the generic ones are true of many).
        pool = texts.flatten(0, 1)  # (N·L, m, n)
        meanings = [meaning for links in chains for _, meaning in links]
        result["traversal"] = []
        for s in torch.linspace(1.0, 0.0, steps).tolist():
            moved = towards_origin(model, images[:traversal_images], s)
            found = model.similarity(moved, pool).argmax(dim=1).cpu()  # (T,)
            levels = (found % LEVELS).float()
            true = [any(meanings[int(k)].matches(obj) for obj in scenes[i].objects) for i, k in enumerate(found)]
            result["traversal"].append({"s": s, "mean_level": float(levels.mean()), "level_std": float(levels.std()),
                                        "true_fraction": sum(true) / len(true)})
    return result


def analyze_hierarchy(loaded: Pretrained, out_dir, size: int = 500, traversal_images: int = 100,
                      steps: int = 11, batch_size: int = 256) -> dict:
    """Write hierarchy.png and hierarchy.json (see the module text) for the first `size` test scenes, beside the same
    measures of an untrained model of the same config and seed (what the captions' lengths and the towers' start give
    without training)."""
    from topoclip.data.scenes.dataset import SceneDataset
    from topoclip.model.clip import CLIP

    model, config = loaded.model, loaded.config
    if config.model.topology not in WITH_ORIGIN:
        raise ConfigError(f"the hierarchy measure needs an origin (distance to it orders generic before specific); "
                          f"{config.model.topology} has none: it applies to {', '.join(WITH_ORIGIN)}")
    dataset = SceneDataset(config.data.scenes, "test")
    if not 1 <= size <= len(dataset) or not 1 <= traversal_images <= size or steps < 2:
        raise ConfigError(f"--size must be in [1, {len(dataset)}] (the test split), --traversal-images in [1, --size] "
                          f"and --steps ≥ 2; got {size}, {traversal_images}, {steps}")
    scenes = [dataset.scene(i) for i in range(size)]
    chains = [chain(scene.objects[0]) for scene in scenes]
    captions = [text for links in chains for text, _ in links]
    pixels = [dataset.image(i) for i in range(size)]
    torch.manual_seed(config.train.seed)  # as the trainer seeds before it builds the model
    untrained = CLIP(config.model).to(loaded.device).eval()
    result = {"analysis": "hierarchy", "model": loaded.name, "checkpoint": str(loaded.checkpoint),
              "topology": config.model.topology, "size": size, "traversal_images": traversal_images,
              "template": TEMPLATE, "levels": LEVEL_NAMES,
              "curvature": model.curvature_value.item() if model.curvature is not None else None}
    for name, subject in (("trained", model), ("untrained", untrained)):
        texts = embed_texts(subject, loaded.tokenizer, captions, batch_size, loaded.device)
        images = embed_images(subject, pixels, loaded.transform, batch_size, loaded.device)
        result[name] = measures(subject, texts.view(size, LEVELS, *subject.embedding_shape), images, scenes, chains,
                                traversal_images, steps)
    result["plots"] = [plot(result, out_dir).name]
    write_json(out_dir, "hierarchy", result)
    return result
