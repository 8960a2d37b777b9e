"""The engine core behind a client: in this process (InprocClient) or its own (MPClient)."""
