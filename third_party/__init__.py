"""Optional adapters for outside engines and tools (README.md here); jrl/ never imports them."""
