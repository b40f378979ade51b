"""Model families behind one contract (``family``): Llama (``llama``) and decoding (``decode``)."""
