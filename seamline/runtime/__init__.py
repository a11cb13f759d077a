"""Runtime: sampling (pure) and the engine that turns token ids into token ids."""
