"""The command-line jobs: one thin ``main(argv)`` per file over what puma/ does.

Run one as a script (``python jobs/embed.py ...``, ``ray job submit -- python jobs/train.py ...``: each
puts the repository root on sys.path itself) or import it from the repository root
(``from jobs import embed; embed.main([...])``), as the tests do.
"""
