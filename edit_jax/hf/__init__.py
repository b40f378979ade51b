"""Hugging Face in and out: ``load`` (a Llama directory's config and weights), ``export`` (a run as
a Hugging Face directory), ``tokenizer`` (the byte tokenizer as tokenizer.json)."""
