"""The tiers below host memory, one folder each; nothing but the tier's builder imports them."""
