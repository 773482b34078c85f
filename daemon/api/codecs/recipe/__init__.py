"""The DeepSeek codec: deepseek-recipe protocol conversion, prompt encoding and stream parsing."""
