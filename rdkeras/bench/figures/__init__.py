"""The paper suite's report, one module a figure: each renders its tables and plot from ``results.json``
(``section(results, out)``) and says under each target it missed why, from the step's measured parts.
``rdkeras.bench.report`` puts the sections together; ``common`` holds what they share."""
