"""Building blocks of the model code: parallel linears, embeddings, RoPE, attention, norms."""
