"""slime.backends (trainer-side helpers custom loss functions import)."""
