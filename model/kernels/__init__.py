"""Custom-kernel hooks: the model's hot spots, each a plain torch reference (what eager runs and
the tests trust) that export can replace by a kernel IREE compiles."""
