"""The figures of ``fedguide analyze``, one module each, registered in ``fedguide.analysis.figure.FIGURES``
(every public module here is imported at the registry's first lookup). What they share: the run opened
for analysis (``analysis.opened.AnalysisRun``) and the writers of a PNG and its JSON (``analysis.output``).
"""
