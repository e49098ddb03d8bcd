"""`manage.py make_tiny_model`: a small random causal LM with its tokenizer, to deploy in demos
and tests where no model hub is reachable."""
