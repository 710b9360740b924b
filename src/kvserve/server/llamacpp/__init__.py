"""llama.cpp's server routes: fill in the middle, tokenize, detokenize."""
