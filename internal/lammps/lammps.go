// Package lammps is LAMMPS's Lennard-Jones melt (Debian's lmp and lammps-examples), the MPI workload of
// ftkit's end-to-end tests and of `ftbench mpi-crash`: its input, and the thermodynamic table that tells
// whether two runs computed the same thing.
package lammps

import (
	"fmt"
	"os"
	"strings"
)

// MeltExample is the example input Debian's lammps-examples installs.
const MeltExample = "/usr/share/lammps/examples/melt/in.melt"

// MeltInput is the melt example (4000 atoms) run for 3000 steps with thermodynamic output every 500: 7
// rows. A missing example is an error wrapping fs.ErrNotExist.
func MeltInput() ([]byte, error) {
	b, err := os.ReadFile(MeltExample)
	if err != nil {
		return nil, fmt.Errorf("LAMMPS's example input (scripts/setup.sh installs lammps-examples): %w", err)
	}
	lines := strings.Split(string(b), "\n")
	edited := 0
	for i, l := range lines {
		switch f := strings.Fields(l); {
		case len(f) == 2 && f[0] == "run":
			lines[i], edited = "run 3000", edited+1
		case len(f) == 2 && f[0] == "thermo":
			lines[i], edited = "thermo 500", edited+1
		}
	}
	if edited != 2 {
		return nil, fmt.Errorf("%s has no run and thermo lines to edit", MeltExample)
	}
	return []byte(strings.Join(lines, "\n")), nil
}

// ThermoTable is the rows of the thermodynamic table (step, temperature, energies, pressure) printed so
// far in out. Every value depends on every atom's trajectory, so on every byte the ranks exchanged.
func ThermoTable(out string) []string {
	var rows []string
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) == 6 && f[0] != "Step" && strings.Trim(f[0], "0123456789") == "" {
			rows = append(rows, strings.Join(f, " "))
		}
	}
	return rows
}
