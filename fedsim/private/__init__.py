"""In-process private federation: real coordinator rounds, the private-round simulator, private runs per family."""
