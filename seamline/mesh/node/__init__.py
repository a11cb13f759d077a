"""A node process: its control link, loading its layers (fetching their fragments), the stage it runs."""
