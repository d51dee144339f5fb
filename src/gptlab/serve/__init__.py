"""Serving: an OpenAI-compatible completions API with dynamic batching, and a web explorer.

`create_app(model, tokenizer, name=...)` (in gptlab.serve.app) builds the FastAPI app;
`gptlab serve --model M` runs it.
"""
