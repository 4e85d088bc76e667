class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: names the tensor or file to fix."""
