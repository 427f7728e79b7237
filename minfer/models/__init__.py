"""The model families. base.py: the shared façade; registry.py: model_type -> family; one package
per family, each a declaration (spec.py) plus math (math.py) plus its public class (model.py)."""
