"""The edge that touches a live server: its process tree, HTTP to it, and the cards under it."""
