"""What the user gets: best.json (result), the run folder, the console, the exports to each stack
(export/, export_formats, hf_checkpoint for the exported FSDP2 script), and the HTML report."""
