"""Chat-output post-processing: tool calls and reasoning split out of generated text."""
