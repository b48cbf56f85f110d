"""Model-free proposers for speculative decoding: guesses of a request's next tokens from its own tokens."""
