"""lm-eval task files (YAML) for offline copies of LAMBADA, PIQA and HellaSwag, and their data loader `local_data`."""
