"""Commands for people at a terminal: `ferry up`, `ferry generate`, and the demo-model builder."""
