package lammps

import (
	"errors"
	"io/fs"
	"slices"
	"strings"
	"testing"
)

// TestThermoTable: the table's rows are found among LAMMPS's other output, its header left out.
func TestThermoTable(t *testing.T) {
	out := `LAMMPS (29 Sep 2021 - Update 2)
Setting up Verlet run ...
Per MPI rank memory allocation (min/avg/max) = 2.706 | 2.706 | 2.706 Mbytes
Step Temp E_pair E_mol TotEng Press 
       0            3   -6.7733681            0   -2.2744931   -3.7033504 
     500    1.6842865   -4.8082494            0   -2.2824513    5.5666131 
Loop time of 9.1 on 3 procs for 3000 steps with 4000 atoms
Total wall time: 0:00:09
`
	want := []string{"0 3 -6.7733681 0 -2.2744931 -3.7033504", "500 1.6842865 -4.8082494 0 -2.2824513 5.5666131"}
	if got := ThermoTable(out); !slices.Equal(got, want) {
		t.Errorf("ThermoTable = %q, want %q", got, want)
	}
}

// TestMeltInput: the example is edited to 3000 steps with a row every 500; without lammps-examples the
// error says what to install.
func TestMeltInput(t *testing.T) {
	b, err := MeltInput()
	if errors.Is(err, fs.ErrNotExist) {
		if !strings.Contains(err.Error(), "lammps-examples") {
			t.Errorf("error %q does not name the package", err)
		}
		t.Skipf("SKIPPED LOUDLY: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	in := string(b)
	for _, want := range []string{"\nrun 3000", "\nthermo 500"} {
		if !strings.Contains(in, want) {
			t.Errorf("input lacks %q:\n%s", want, in)
		}
	}
}
