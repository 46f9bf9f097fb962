"""What a run reports: the typed record (report.json) and the page that shows it."""
