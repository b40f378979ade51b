"""A-EDiT with workers as separate programs that meet through an exchange (docs/developer/exchange.md)."""
