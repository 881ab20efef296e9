"""In-process federation without privacy, one module per model family, and the runs it saves."""
