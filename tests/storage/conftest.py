import os
import sys

# The helpers of tests/ (damage.py, killer.py) import from here too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
