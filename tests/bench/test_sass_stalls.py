"""benchmarks/kernels/sass_stalls.py on a source page in the shape ncu exports (a preamble, then the table)."""
import pytest

from benchmarks.kernels.sass_stalls import read_rows, summary

PAGE = '''"Kernel Name","chunk_state_f16"
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"0x100","HMMA.1688.F32.TF32 R4, R8, R12, R4","600","550"
"0x110","LDSM.16.M88.4 R8, [R2]","300","120"
"0x120","@P0 BRA 0x100","100","20"
"0x130","HMMA.1688.F32.TF32 R16, R8, R14, R16","0","0"
'''


def test_rows_and_summary():
    rows, col = read_rows(PAGE)
    assert col == "Warp Stall Sampling (All Samples)" and len(rows) == 4
    text = summary(rows, top=2)
    lines = text.splitlines()
    assert lines[0] == "4 instructions, 1,000 samples"
    assert "60.0%" in lines[1] and "HMMA" in lines[1] and "LDSM" in lines[2]
    assert lines[-1].startswith("by opcode: HMMA 60.0%, LDSM 30.0%, BRA 10.0%")


def test_a_file_without_the_table_is_refused():
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        read_rows('"Kernel Name","x"\n"a","b"\n')


def test_stall_reasons_summed_and_per_instruction():
    page = ('"# Address","Source","Warp Stall Sampling (All Samples)","stall_wait","stall_barrier",'
            '"stall_wait (Not Issued)"\n'
            '"0x100","HMMA.1688.F32.TF32 R4, R8, R12, R4","30","25","5","9"\n'
            '"0x110","LDSM.16.M88.4 R8, [R2]","10","0","10","0"\n')
    rows, _ = read_rows(page)
    assert rows[0]["reasons"] == {"wait": 25.0, "barrier": 5.0}      # the "(Not Issued)" copy left out
    lines = summary(rows, top=2).splitlines()
    assert lines[1] == "by reason: wait 62.5%, barrier 37.5%"
    assert lines[2].endswith("wait 25, barrier 5") and lines[3].endswith("barrier 10")
