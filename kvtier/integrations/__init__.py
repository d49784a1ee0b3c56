"""Other engines as clients of the tier library (`kvtier.tier`): each imports its engine
only here, so plain `import kvtier` never imports vLLM."""
