"""``slime.utils``: the helpers slime plugins import (types, misc, http_utils, async_utils, processing_utils)."""
