"""Workers: the loops that drive launches, watch running sandboxes and reconcile."""
