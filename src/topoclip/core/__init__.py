"""The lowest layer: the mathematics every layer above shares (geometry, losses, the temperature), errors, the door
for untrusted files, atomic writes, a folder's lock, DataLoader workers and process groups. It imports no other layer
of topoclip."""
