"""Exporting trained weights to other formats (Hugging Face Llama) and importing them back."""
