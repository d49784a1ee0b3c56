"""The bytes side that computes: the decoder, its paged attention, loaders, the sampler."""
