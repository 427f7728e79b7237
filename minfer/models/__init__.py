"""The model families. base.py: the shared façade; registry.py: model_type -> family; one package
per family, each a declaration (config.py, weights.py, buffers.py; spec.py's Family ties them)
plus math (math.py) plus its public class (model.py)."""
