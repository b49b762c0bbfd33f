"""The PostgreSQL store's Python around its statements, pinned one behaviour per file: error
conversion (conflicts, lost connections, refused checkouts, out of resources), connections
released, reset or terminated on every path, literals, fences and claims. Each test here was
written for a behaviour no other test pinned (found by hand-made mutations of the store)."""
