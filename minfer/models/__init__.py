"""The model families. base.py: the shared façade; registry.py: model_type -> family; one package
per family, each a declaration (config.py, weights.py, buffers.py; family.py's FAMILY ties them)
plus math (math.py) plus its public class (model.py)."""
