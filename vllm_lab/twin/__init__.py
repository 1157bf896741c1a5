"""The twin: a simulator of vLLM V1's scheduler, paged KV cache and step timing.

``engine`` schedules like vLLM V1, ``steptime`` prices each step from a ``profile``, ``predictor``
drives the same engine on a virtual clock, and ``server`` serves it over vLLM's HTTP API.
"""
