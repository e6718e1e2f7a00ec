import argparse
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")
def main(args):
    return 0
