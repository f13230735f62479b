#!/usr/bin/env python3
"""Loss and held-out accuracy curves of one or several runs.

    python3 tools/plot_metrics.py RUN.jsonl [RUN2.jsonl ...] -o curves.png
                                  [--labels A,B] [--title T]

Each file is what train_gpt / train_mlp --metrics FILE wrote: one JSON
object per logged step (step, loss, lr, grad_norm, tokens_per_s or
samples_per_s, peak_bytes, plan_bytes, train_s, and heldout_accuracy where
it was measured). The left panel is the training loss against the step
(log scale), the right one held-out accuracy, one line per file. A line
that is not JSON is an error naming the file and line.

matplotlib comes from a virtual environment that this script creates under
build/plot-venv (pip install matplotlib) when the running Python lacks it.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, 'build', 'plot-venv')


def ensure_matplotlib():
    """Imports matplotlib, or re-runs this script in the venv that has it."""
    try:
        import matplotlib  # noqa: F401
        return
    except ImportError:
        pass
    py = os.path.join(VENV, 'bin', 'python3')
    if os.path.abspath(sys.executable) == os.path.abspath(py) or os.environ.get('PLOT_METRICS_VENV'):
        sys.exit('plot_metrics: matplotlib is missing in %s (pip install failed?)' % VENV)
    if not os.path.exists(py):
        print('plot_metrics: installing matplotlib into %s' % VENV, file=sys.stderr)
        subprocess.check_call([sys.executable, '-m', 'venv', VENV])
    chk = subprocess.call([py, '-c', 'import matplotlib'], stderr=subprocess.DEVNULL)
    if chk != 0:
        subprocess.check_call([py, '-m', 'pip', 'install', '-q', 'matplotlib'])
    env = dict(os.environ, PLOT_METRICS_VENV='1')
    os.execve(py, [py, os.path.abspath(__file__)] + sys.argv[1:], env)


def read_run(path):
    recs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError as e:
                sys.exit('plot_metrics: %s line %d is not JSON: %s' % (path, i, e))
            if not isinstance(r, dict) or 'step' not in r:
                sys.exit('plot_metrics: %s line %d has no step' % (path, i))
            recs.append(r)
    if not recs:
        sys.exit('plot_metrics: %s has no records' % path)
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('files', nargs='+', help='metrics files (JSON lines)')
    ap.add_argument('-o', '--output', required=True, help='the PNG to write')
    ap.add_argument('--labels', help='comma-separated names of the runs (default: file names)')
    ap.add_argument('--title', default='', help='a title above both panels')
    args = ap.parse_args()
    runs = [read_run(p) for p in args.files]  # errors before the venv's slow start
    labels = args.labels.split(',') if args.labels else [os.path.basename(p) for p in args.files]
    if len(labels) != len(args.files):
        sys.exit('plot_metrics: %d labels for %d files' % (len(labels), len(args.files)))
    ensure_matplotlib()
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(8, 3.2))
    any_acc = False
    for recs, label in zip(runs, labels):
        # a resumed run appends: a step logged twice keeps its last record
        by_step = {}
        for r in recs:
            by_step.setdefault(r['step'], {}).update(r)
        steps = sorted(by_step)
        loss = [(s, by_step[s]['loss']) for s in steps if by_step[s].get('loss') is not None]
        acc = [(s, 100.0 * by_step[s]['heldout_accuracy']) for s in steps
               if by_step[s].get('heldout_accuracy') is not None]
        if loss:
            ax_loss.plot([s for s, _ in loss], [v for _, v in loss], label=label, linewidth=1.2)
        if acc:
            any_acc = True
            ax_acc.plot([s for s, _ in acc], [v for _, v in acc], marker='.', label=label,
                        linewidth=1.2)
    ax_loss.set_yscale('log')
    ax_loss.set_xlabel('step')
    ax_loss.set_ylabel('training loss')
    ax_loss.grid(True, which='both', alpha=0.3)
    ax_acc.set_xlabel('step')
    ax_acc.set_ylabel('held-out accuracy (%)')
    ax_acc.set_ylim(0, 101)
    ax_acc.grid(True, alpha=0.3)
    if not any_acc:
        ax_acc.text(0.5, 0.5, 'no held-out accuracy in these runs', ha='center', va='center',
                    transform=ax_acc.transAxes)
    ax_loss.legend(fontsize=8)
    if any_acc:
        ax_acc.legend(fontsize=8, loc='lower right')
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.output, dpi=90)
    print('plot_metrics: wrote %s (%d run%s)' % (args.output, len(runs), '' if len(runs) == 1 else 's'))


if __name__ == '__main__':
    main()
