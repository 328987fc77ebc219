"""Model definitions: ``ModelConfig`` and the Llama-family decoder."""
