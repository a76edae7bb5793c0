"""The Slurm platform: ``aegis slurm submit`` writes an sbatch script whose coordinator runs the
master and one ``srun`` step per pod (``aegis agent``); bad nodes are drained and excluded."""
