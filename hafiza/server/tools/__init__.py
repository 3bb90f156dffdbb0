"""Tool use: definitions and choices from both APIs, rendering into the prompt, and parsing the model's calls."""
