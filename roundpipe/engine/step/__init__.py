"""The optimizer side: host state, the per-layer asynchronous step protocol, loss scaling, staleness."""
