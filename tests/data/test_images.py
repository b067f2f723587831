"""Decoding a user's images (every awkward format, every broken one) and cleaning captions."""
import numpy as np
import pytest
from PIL import Image

from topoclip.data.images import clean_caption, decode_image, to_rgb
from topoclip.data.quality import BadSample

from _user_data import SIZE, TRANSFORM, bad_images, encode, good_images, noise


@pytest.mark.parametrize("name", list(good_images()))
def test_decode_image_handles_awkward_formats(name):
    data, _ = good_images()[name]
    image = decode_image(data)
    assert image.mode == "RGB"
    assert min(image.size) >= 2

def test_decode_image_colour_decisions():
    images = good_images()
    rgba = np.asarray(decode_image(images["rgba_png"][0]))
    assert rgba[0, 0].tolist() == [255, 255, 255]  # transparent -> white
    assert rgba[5, 5].tolist() == [255, 0, 0]
    palette = np.asarray(decode_image(images["palette_transparent_png"][0]))
    assert palette[0, 0].tolist() == [255, 255, 255] and palette[1, 1].tolist() == [10, 200, 30]
    sixteen = np.asarray(decode_image(images["sixteen_bit_png"][0]))[..., 0]
    assert sixteen.tolist() == [[0, 128], [255, 200]]  # scaled by 255 / 65535, not clipped at 255
    cmyk = np.asarray(decode_image(images["cmyk_jpeg"][0])).astype(int)
    assert cmyk[10, 10, 0] > 200 and cmyk[10, 10, 1] < 60 and cmyk[10, 10, 2] < 60  # C=0 M=Y=255: red
    wide = decode_image(images["wide_20000x4_png"][0])
    assert wide.size == (20000, 4)
    assert TRANSFORM(wide).shape == (3, SIZE, SIZE)

@pytest.mark.parametrize("name", list(bad_images()))
def test_decode_image_raises_typed_bad_sample(name):
    data, _, kind = bad_images()[name]
    with pytest.raises(BadSample) as caught:
        decode_image(data)
    assert caught.value.kind == kind

def test_decode_image_limits_missing_file_and_exif(tmp_path):
    with pytest.raises(BadSample) as caught:
        decode_image(tmp_path / "nope.jpg")
    assert caught.value.kind == "missing_file"
    with pytest.raises(BadSample, match="huge_image"):
        decode_image(encode(noise(40, 40), "PNG"), max_pixels=1000)  # the setting, below PIL's own guard
    with pytest.raises(BadSample, match="tiny_image"):
        decode_image(encode(noise(3, 40), "PNG"), min_size=4)
    assert decode_image(encode(Image.new("RGB", (1, 1)), "PNG"), min_size=1).size == (1, 1)
    # EXIF orientation 6 (rotate 90 degrees clockwise): stored 30 x 10, shown 10 x 30.
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = decode_image(encode(noise(10, 30), "JPEG", exif=exif.tobytes()))
    assert rotated.size == (10, 30)

def test_decode_image_reduces_large_images_toward_draft_size():
    photo = encode(noise(400, 640, 8).resize((640, 400)), "JPEG")
    assert decode_image(photo).size == (640, 400)
    reduced = decode_image(photo, draft_size=64)
    assert 64 <= min(reduced.size) < 128 and abs(reduced.size[0] / reduced.size[1] - 1.6) < 0.05
    png = decode_image(encode(noise(300, 300), "PNG"), draft_size=100)  # no DCT draft: integer reduce
    assert png.size == (100, 100)

def test_to_rgb_of_32_bit_integer_images():
    assert np.asarray(to_rgb(Image.fromarray(np.array([[0, 65535]], dtype=np.int32), "I")))[0, 1, 0] == 255
    assert np.asarray(to_rgb(Image.fromarray(np.array([[0, 200]], dtype=np.int32), "I")))[0, 1, 0] == 200

def test_clean_caption():
    assert clean_caption(b"  a  dog\n on\tgrass \x00 ") == "a dog on grass"
    assert clean_caption("\ufeffcaf\u00e9") == "caf\u00e9"
    for empty in (b"", "   \n\t", None, "\x00\x01"):
        with pytest.raises(BadSample) as caught:
            clean_caption(empty)
        assert caught.value.kind == "empty_caption"
    for undecodable in (b"caf\xe9 latin-1", b"\xff\xfe\xfa", "caf\udce9"):  # last: surrogateescape'd byte
        with pytest.raises(BadSample) as caught:
            clean_caption(undecodable)
        assert caught.value.kind == "bad_encoding"
