"""dsv4.contract: what the exporter writes and the runtime reads, torch-free (numpy and the base
install only). The bottom of the dependency order: model/, export/, train/ and runtime/ import it,
it imports none of them."""
