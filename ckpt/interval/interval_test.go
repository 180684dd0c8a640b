package interval

import (
	"sync"
	"testing"
	"time"
)

func near(got, want time.Duration) bool {
	d := got - want
	return d > -time.Millisecond && d < time.Millisecond
}

const s = time.Second

// Expected values worked out by hand; x = d/2M.
func TestFormulas(t *testing.T) {
	tests := []struct {
		name        string
		d, m        time.Duration
		young, daly time.Duration
	}{
		// sqrt(2·50·10000) = 1000; x = 0.0025, sqrt(x) = 0.05;
		// bracket = 1 + 0.05/3 + 0.0025/9 = 1.0169444…; Daly = 1016.9444… − 50.
		{"d=50s M=10000s", 50 * s, 10000 * s, 1000 * s, 966944444 * time.Microsecond},
		// sqrt(2·200·10000) = 2000; x = 0.01; bracket = 1 + 0.1/3 + 0.01/9
		// = 1.0344444…; Daly = 2068.8888… − 200.
		{"d=200s M=10000s", 200 * s, 10000 * s, 2000 * s, 1868888889 * time.Microsecond},
		// sqrt(2·5000·10000) = 10000; x = 0.25; bracket = 1 + 1/6 + 1/36 = 43/36;
		// Daly = 11944.444… − 5000.
		{"d=5000s M=10000s", 5000 * s, 10000 * s, 10000 * s, 6944444444 * time.Microsecond},
		// sqrt(2·18·3600) = 360; x = 18/7200 = 0.0025, same bracket as the
		// first row; Daly = 366.1 − 18.
		{"d=18s M=1h", 18 * s, time.Hour, 360 * s, 348100 * time.Millisecond},
		// sqrt(2·0.5·100) = 10; x = 0.0025; Daly = 10.169444… − 0.5.
		{"d=0.5s M=100s", 500 * time.Millisecond, 100 * s, 10 * s, 9669444 * time.Microsecond},
		// d = 2M: Daly's formula no longer applies and tau = M; Young = sqrt(4·10^8).
		{"d=2M", 20000 * s, 10000 * s, 20000 * s, 10000 * s},
		// d > 2M: tau = M; Young = sqrt(6·10^8) = 24494.897…
		{"d>2M", 30000 * s, 10000 * s, 24494897428 * time.Microsecond, 10000 * s},
		{"zero cost", 0, 10000 * s, 0, 0},
		{"zero mtbf", 50 * s, 0, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Young(tc.d, tc.m); !near(got, tc.young) {
				t.Errorf("Young = %v, want %v", got, tc.young)
			}
			if got := Daly(tc.d, tc.m); !near(got, tc.daly) {
				t.Errorf("Daly = %v, want %v", got, tc.daly)
			}
		})
	}
}

func TestPolicy(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		observe []time.Duration
		cost    time.Duration
		want    time.Duration
	}{
		{"fixed ignores observations", Config{Fixed: 90 * s}, []time.Duration{time.Hour}, 0, 90 * s},
		{"initial cost before any dump", Config{MTBF: 10000 * s, InitialCost: 50 * s}, nil, 50 * s, 966944444 * time.Microsecond},
		// The first observation replaces the guess; then EWMA with alpha 0.5:
		// 40 → 0.5·60 + 0.5·40 = 50.
		{"ewma", Config{MTBF: 10000 * s, InitialCost: time.Hour, Alpha: 0.5}, []time.Duration{40 * s, 60 * s}, 50 * s, 966944444 * time.Microsecond},
		// 10 → 0.5·20 + 0.5·10 = 15 → 0.5·40 + 0.5·15 = 27.5.
		{"ewma three", Config{MTBF: 10000 * s, InitialCost: s, Alpha: 0.5}, []time.Duration{10 * s, 20 * s, 40 * s}, 27500 * time.Millisecond, Daly(27500*time.Millisecond, 10000*s)},
		{"young", Config{MTBF: 10000 * s, InitialCost: 50 * s, Formula: FormulaYoung}, nil, 50 * s, 1000 * s},
		// sqrt(2·0.001·100) = 0.447 s, below the default 1 s floor.
		{"min clamp", Config{MTBF: 100 * s, InitialCost: time.Millisecond}, nil, time.Millisecond, s},
		{"max clamp", Config{MTBF: 10000 * s, InitialCost: 50 * s, Max: 500 * s}, nil, 50 * s, 500 * s},
		{"cost above 2M", Config{MTBF: 10 * s, InitialCost: 25 * s}, nil, 25 * s, 10 * s},
		{"negative observation ignored", Config{MTBF: 10000 * s, InitialCost: 50 * s}, []time.Duration{-s}, 50 * s, 966944444 * time.Microsecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			for _, o := range tc.observe {
				p.Observe(o)
			}
			if tc.cfg.Fixed == 0 && p.Cost() != tc.cost {
				t.Errorf("Cost = %v, want %v", p.Cost(), tc.cost)
			}
			if got := p.Interval(); !near(got, tc.want) {
				t.Errorf("Interval = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestNewRejects(t *testing.T) {
	for name, cfg := range map[string]Config{
		"nothing":         {},
		"negative fixed":  {Fixed: -s},
		"no initial cost": {MTBF: time.Hour},
		"alpha too big":   {MTBF: time.Hour, InitialCost: s, Alpha: 1.5},
		"negative alpha":  {MTBF: time.Hour, InitialCost: s, Alpha: -0.1},
		"max below min":   {MTBF: time.Hour, InitialCost: s, Min: time.Minute, Max: s},
		"unknown formula": {MTBF: time.Hour, InitialCost: s, Formula: 7},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New accepted %+v", name, cfg)
		}
	}
}

func TestPolicyConcurrent(t *testing.T) {
	p, err := New(Config{MTBF: time.Hour, InitialCost: s})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 1000 {
				p.Observe(2 * s)
				_ = p.Interval()
			}
		})
	}
	wg.Wait()
	// Every observation is 2 s, so the EWMA must be exactly 2 s.
	if p.Cost() != 2*s {
		t.Errorf("Cost = %v", p.Cost())
	}
}

// TestSetMTBF: the interval follows the MTBF set after New (a failure predictor that starts or stops
// answering); a non-positive one is ignored.
func TestSetMTBF(t *testing.T) {
	p, err := New(Config{MTBF: time.Hour, InitialCost: s})
	if err != nil {
		t.Fatal(err)
	}
	p.SetMTBF(10 * time.Hour)
	if got, want := p.Interval(), Daly(s, 10*time.Hour); got != want {
		t.Errorf("Interval after SetMTBF(10h) = %v, want %v", got, want)
	}
	p.SetMTBF(0)
	if got, want := p.Interval(), Daly(s, 10*time.Hour); got != want {
		t.Errorf("Interval after SetMTBF(0) = %v, want %v (unchanged)", got, want)
	}
}

// TestFixedPolicyTracksCost: a fixed period ignores the dump cost, but the cost is still smoothed over every
// dump (the agent caps a fixed period by Daly's interval for a predicted failure, computed from Cost): with
// every observation after the first ignored, a job whose first dump was a young process's 20 ms was
// snapshotted, while a failure was predicted, as if every later dump cost 20 ms.
func TestFixedPolicyTracksCost(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		observe []time.Duration
		cost    time.Duration
	}{
		// 0.02 → 0.3·10 + 0.7·0.02 = 3.014 → 0.3·10 + 0.7·3.014 = 5.1098.
		{"default alpha", Config{Fixed: time.Minute, InitialCost: s}, []time.Duration{20 * time.Millisecond, 10 * s, 10 * s}, 5109800 * time.Microsecond},
		// 40 → 0.5·60 + 0.5·40 = 50.
		{"alpha 0.5", Config{Fixed: time.Minute, Alpha: 0.5}, []time.Duration{40 * s, 60 * s}, 50 * s},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			for _, o := range tc.observe {
				p.Observe(o)
			}
			if got := p.Cost(); !near(got, tc.cost) {
				t.Errorf("Cost = %v, want %v", got, tc.cost)
			}
			if got := p.Interval(); got != tc.cfg.Fixed {
				t.Errorf("Interval = %v, want the fixed %v", got, tc.cfg.Fixed)
			}
		})
	}
}

// TestHugeValuesDoNotWrap: a formula whose optimum is beyond the longest time.Duration (some 292 years)
// gives that longest one. Before, the float64 converted to a negative duration, which Interval clamped to
// its floor: the longest intervals asked for became the shortest.
func TestHugeValuesDoNotWrap(t *testing.T) {
	const longest = time.Duration(1<<63 - 1)
	if got := Young(longest, longest); got != longest {
		t.Errorf("Young(longest, longest) = %v, want %v", got, longest)
	}
	p, err := New(Config{MTBF: longest, InitialCost: longest / 2, Formula: FormulaYoung})
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Interval(); got != longest {
		t.Errorf("Interval of Young's policy for huge cost and MTBF = %v, want %v", got, longest)
	}
}
