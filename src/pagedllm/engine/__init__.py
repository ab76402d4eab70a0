"""The engine: LLMEngine (add_request / step / abort), its config, outputs and figures."""
