"""pagedllm on Ray Serve: N engine replicas behind one OpenAI-compatible ingress, with a
prefix-cache-aware request router. Needs the `ray` extra (`pip install pagedllm[ray]`);
nothing else in pagedllm imports this package."""
