"""``slime.rollout.rm_hub.math_dapo_utils``: DAPO's math reward rule (``plugins.math_answers`` has
it and says how its normalisation differs from the upstream one)."""

from plugins.math_answers import (  # noqa: F401
    compute_score, is_correct_minerva, is_correct_strict_box, last_boxed_only_string, normalize_final_answer,
    remove_boxed, verify)
