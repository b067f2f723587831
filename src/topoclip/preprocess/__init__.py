"""Raw inputs to model inputs: the tokenizer and the image transforms. Imports only topoclip.core."""
