"""The wire: frames (strict codec), typed control messages, and links that carry them."""
